"""A training run: its options (`options`), the loop (`loop.train`), the run directory, optimizers,
evaluation, the processes of a torchrun job, RNG state, throughput and the loss plot. Built on
`model` and `data`; the command line that checks a run's options is in `cli`."""
