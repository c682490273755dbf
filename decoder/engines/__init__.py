"""Adapters that give serving engines redraft's drafts, one module per engine:

- `vllm`: `RedraftProposer`, vLLM's custom speculative proposer;
- `sglang`: the speculative algorithm `REDRAFT`, an SGLang plugin;
- `llama_cpp`: `RedraftDraft`, a llama-cpp-python `LlamaDraftModel` (one sequence, one chain
  per forward), and `Llama`, which builds a `llama_cpp.Llama` with the settings that keep
  drafted greedy output identical to plain decoding.

The engine-neutral parts live beside them: `settings` (where an adapter finds its draft
service), `streams` (one generation's drafts from the draft service or an in-process
datastore, falling back to prompt lookup when the service fails), `step_drafts` (every sequence
of an engine step in one batched call), `rows` (which sequence each row of a batch holds)
and `pacing` (an online rule that stops drafting when drafts do not pay on the machine at
hand), `adapter_counters` (what each adapter drafted and its engine accepted, counted in
process) and `adapter_prometheus` (those counts on a Prometheus `/metrics`).
"""
