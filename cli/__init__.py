"""The command line of every entry point: the one error guard (`errors`), Hydra's composition and
schemas (`configs`), a training run's options checked into a RunConfig with the resume merge and the
recipe choice (`options`), and the `python -m cli.prepare` and `python -m cli.convert` commands.
The library (`model`, `data`, `training`) never imports it."""
