"""The projection of a Llama step on N GPUs with the TP collectives decomposed for overlap (alpha-beta)."""
