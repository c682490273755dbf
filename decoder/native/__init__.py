"""The verifier's compiled linear kernel (_blocks.cpp, built at install): y = x W^T over a
model's weights as it ships them (GGUF Q4_1 / Q8_0 blocks, or dense rows), every weight block
read once per call for all of its rows, and each row's result independent of the others and
of the thread count. `redraft.decoder.block_linear` is its Python face.
"""

from redraft.decoder.native import _blocks

__all__ = ["_blocks"]
