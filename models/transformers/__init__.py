"""A model server on Hugging Face transformers (see app.py)."""
