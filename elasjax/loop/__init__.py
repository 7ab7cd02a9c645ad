"""The training loop: the trainer and the one state it threads, data by step, the step and its
checks, recovery, cut-over, admission, and the start on a fresh or resumed job."""
