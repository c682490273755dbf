"""Models the decoder runs, one module per job: `loading` (a model name to a model, with its
device and dtype), `int8` (int8 linear layers, an int8 copy of a model), `int8_decoder` (the
lean int8 decoder for drafting), `early_exit` (a model's first layers)."""
