"""Reading and writing other formats: Hugging Face Llama checkpoints."""
