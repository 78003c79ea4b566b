"""specd's training recipe: the embedded default pair (tokenizer, target, distilled draft) and `specd distill`."""
