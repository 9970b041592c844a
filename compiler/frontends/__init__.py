"""Model frontends: each turns a model source into a torch module plus tokenizer."""
