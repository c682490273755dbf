"""The benchmark's `llama-cpp` method: plain llama-cpp-python decoding of the same GGUF, the
engine a user would otherwise pick on a CPU, interleaved with the other methods.

It runs the GGUF in its own quantization (another model than the dense one the other methods
run), so its tokens are not compared with `hf-greedy`'s; it answers the same prompt token ids
(the chat template applied by redraft's tokenizer), greedy, with `--threads` threads.
"""

from __future__ import annotations

import time

from redraft.decoder.bench.methods import LLAMA_CPP, Method, TurnResult
from redraft.decoder.text import chat_ids


class LlamaCppMethod(Method):
    """llama-cpp-python's own greedy loop, one forward per new token."""

    name = LLAMA_CPP
    compared = False  # another model (quantized): its tokens are not checked for identity

    def __init__(self, model_name: str | None, tokenizer, threads: int) -> None:
        # lazy: llama-cpp-python is an optional dependency, needed by this method only
        from redraft.decoder.engines.llama_cpp import Llama, greedy_tokens

        self._greedy = greedy_tokens
        self.tokenizer = tokenizer
        self.llm = Llama(model_name, n_ctx=8192, n_threads=threads, n_threads_batch=threads,
                         verbose=False)
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
        tokens = self._greedy(llm, ids, max_new_tokens)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return TurnResult(tokens, text, self.evals, seconds, self.evals, 0, cpu)

    def close(self) -> None:
        self.llm.close()
