"""Launching: submission of an experiment's stages (`submit`, `stages`), what a submitted job calls (`callables`),
the scheduler's view and the job journal (`scheduler`), the launch manifest (`manifest`) and `study status`
(`status`)."""
