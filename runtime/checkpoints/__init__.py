"""Checkpoint dialects: a Hugging Face model folder read as data (config, generation config, RoPE
scaling, safetensors weights, GPTQ/AWQ and compressed-tensors codes, tokenizer), refusing what the
decoder does not compute; pre-quantized linears come out as the decoder's quant-mode objects."""
