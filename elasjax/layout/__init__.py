"""A plan on devices: the train state's layout (shardings, ZeRO storage, the optimizer's
meaning), the pipeline's layer stacks, and the jitted step built from them."""
