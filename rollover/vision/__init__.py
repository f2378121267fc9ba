"""What images need wherever a vision-language model is trained: the model's own processor,
its pixel inputs and its position ids (`inputs`)."""
