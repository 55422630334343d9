"""Hugging Face checkpoints: `checkpoint` reads and writes their safetensors onto a mesh,
`families` records each model_type podtrain's decoder computes, `config_json` maps config.json
onto the decoder's options and back."""
