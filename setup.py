"""Builds the compiled drafting core; everything else is configured in pyproject.toml.

A plain CPython extension in C++17: it needs a C++ compiler and Python's headers, and no
package beyond setuptools (an editable install builds it in place, beside its sources).
"""

from pathlib import Path

from setuptools import Extension, setup

# The core is one translation unit: _core.cpp (its CPython glue) includes a header per concept
# beside it; an edit of any of them rebuilds it.
CORE = Path("datastore/drafting/native")
CORE_HEADERS = sorted(p.name for p in (Path(__file__).parent / CORE).glob("*.h"))

setup(
    ext_modules=[
        Extension(
            "redraft.datastore.drafting.native._core",
            sources=[str(CORE / "_core.cpp")],
            depends=[str(CORE / h) for h in CORE_HEADERS],
            language="c++",
            # No -ffast-math and no contraction into fused multiply-adds: probabilities
            # must round exactly as the Python reference's do.
            extra_compile_args=["-std=c++17", "-O3", "-ffp-contract=off",
                                "-fvisibility=hidden"],
        ),
        # The verifier's linear kernel over the model's own weight blocks: one build for every
        # x86-64 CPU, its AVX2 and AVX512-BF16 paths chosen at run time (target attributes, no
        # -march); the same -ffp-contract=off, so the scalar path rounds as its comments say.
        Extension(
            "redraft.decoder.native._blocks",
            sources=["decoder/native/_blocks.cpp"],
            language="c++",
            extra_compile_args=["-std=c++17", "-O3", "-ffp-contract=off",
                                "-fvisibility=hidden", "-pthread"],
            extra_link_args=["-pthread"],
        ),
        # The storage layer's file maps (a truncated file reads as zeros, not SIGBUS).
        Extension(
            "redraft.datastore._mapping",
            sources=["datastore/_mapping.cpp"],
            language="c++",
            extra_compile_args=["-std=c++17", "-O2", "-fvisibility=hidden"],
        ),
    ]
)
