"""The model: its config, the Llama-family layers as pure functions over a params pytree, weight formats (float and
int8), checkpoint loaders, the tokenizer and chat template, and named real shapes with random weights."""
