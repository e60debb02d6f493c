"""The model: the architecture table (`archs`), the one reader of config.json (`geometry`),
where each rotation and scaling lives (`transforms`), RoPE, the Hadamard transform and the
forward pass (`forward`)."""
