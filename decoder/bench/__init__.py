"""The benchmark behind `redraft bench`: `questions` (Spec-Bench's question file), `methods`
(Hugging Face's generate and redraft's drafters, by name), `greedy` (Spec-Bench side by side,
token identity, speed-ups), `sampling` (repeated sampling with and without learned drafts),
`results` (what a run writes) and `driver` (the one driver both run through)."""
