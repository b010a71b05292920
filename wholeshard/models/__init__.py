"""Models the train job and the bench run: `gpt`, a byte-level GPT."""
