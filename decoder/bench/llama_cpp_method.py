"""The benchmark's `llama-cpp` method: plain llama-cpp-python decoding of the same GGUF, the
engine a user would otherwise pick on a CPU, interleaved with the other methods.

It runs the GGUF in its own quantization (another model than the dense one the other methods
run), so its tokens are not compared with `hf-greedy`'s; it answers the same prompt token ids
(the chat template applied by redraft's tokenizer), greedy, with `--threads` threads.

Tested by: tests/decoder/bench/test_greedy.py
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from redraft.decoder.bench.methods import LLAMA_CPP, Method, TurnResult
from redraft.decoder.bench.questions import BenchError
from redraft.decoder.text import chat_ids
from redraft.proto.models import resolve_model


class LlamaCppMethod(Method):
    """llama-cpp-python's own greedy loop, one forward per new token."""

    name = LLAMA_CPP
    compared = False  # another model (quantized): its tokens are not checked for identity

    def __init__(self, model_name: str | None, tokenizer, threads: int) -> None:
        try:
            import llama_cpp  # lazy: an optional dependency, needed by this method only
        except ImportError:
            raise BenchError("the llama-cpp method needs llama-cpp-python "
                             "(pip install 'redraft[llamacpp]')") from None
        source = resolve_model(model_name)
        if not source.gguf_file:
            raise BenchError(f"the llama-cpp method needs a .gguf model; "
                             f"{source.name!r} is not one")
        self.tokenizer = tokenizer
        self.llm = llama_cpp.Llama(model_path=os.path.join(source.path, source.gguf_file),
                                   n_ctx=8192, n_threads=threads, n_threads_batch=threads,
                                   flash_attn=True, verbose=False)
        self.evals = 0
        evaluate = self.llm.eval

        def counted(tokens):
            self.evals += 1
            return evaluate(tokens)

        self.llm.eval = counted  # `Llama.generate` calls it once per forward

    def run(self, messages: list[dict], max_new_tokens: int) -> TurnResult:
        ids = chat_ids(self.tokenizer, messages)  # outside the clock, as for the others
        llm = self.llm
        llm.reset()  # the whole prompt is evaluated, as every other method does
        self.evals = 0
        t0, c0 = time.perf_counter(), time.process_time()
        tokens = greedy_tokens(llm, ids, max_new_tokens)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return TurnResult(tokens, text, self.evals, seconds, self.evals, 0, cpu)

    def close(self) -> None:
        self.llm.close()


def greedy_tokens(llm, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """llama-cpp-python's own greedy loop over `prompt` (token ids), up to an end-of-generation
    token (left out) or `max_new_tokens` tokens."""
    import llama_cpp  # lazy: see LlamaCppMethod

    out: list[int] = []
    for token in llm.generate(list(prompt), temp=0.0, top_k=1, repeat_penalty=1.0):
        if llama_cpp.llama_vocab_is_eog(llm._model.vocab, token):
            break
        out.append(int(token))
        if len(out) >= max_new_tokens:
            break
    return out
