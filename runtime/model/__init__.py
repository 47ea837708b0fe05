"""The model room: config, checkpoint loading and formats, one file per architecture, the forward pass, attention, RoPE, routing, KV cache, tokenizer."""
