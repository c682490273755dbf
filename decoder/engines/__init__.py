"""Adapters that give serving engines redraft's drafts.

- `llama_cpp`: `RedraftDraft`, a llama-cpp-python `LlamaDraftModel` (one sequence, one chain
  per forward), and `Llama`, which builds a `llama_cpp.Llama` with the settings that keep
  drafted greedy output identical to plain decoding.

The engine-neutral parts live beside them: `streams` (one generation's drafts from the draft
service or an in-process datastore, falling back to prompt lookup when the service fails),
`chain` (the best path of a draft tree, for engines that verify chains) and `pacing` (an
online rule that stops drafting when drafts do not pay on the machine at hand).
"""
