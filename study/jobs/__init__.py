"""What a job or command does with a run directory: prepare its data, profile a trained reference, evaluate it
downstream, export it (training itself is `study.train.loop`). Jobs sit above the libraries they drive and below the
launcher; they never import the planner: a job reads the spec the planner wrote."""
