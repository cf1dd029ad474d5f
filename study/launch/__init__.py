"""Launching: submission of an experiment's stages (`submit`), what a job runs (`jobs`), the scheduler's view and
the job journal (`scheduler`), the launch manifest (`manifest`) and `study status` (`status`)."""
