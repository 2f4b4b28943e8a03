"""The serving layer over the `attn` ops: KV-cache manager (`cache_manager`), model-level
attention backends (`attention`), a compact Llama-like model (`model`), the continuous-batching
engine (`engine`), Hugging Face transformers integration (`hf`) and tensor parallelism (`tp`)."""
