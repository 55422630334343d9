"""Hugging Face checkpoints: `checkpoint` reads and writes their safetensors onto a mesh,
`families` maps each model_type's config.json and tensor names onto podtrain's decoder."""
