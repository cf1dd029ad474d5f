"""What a job or command does with a run directory: prepare its data (`prepare`), profile a trained reference
(`profile`), evaluate it downstream (`eval`), export it (`export`). Training itself is `study.train.loop`.

These sit above the libraries they drive (data, geometry, evaluate, export, track) and below the launcher that
submits them; like the libraries, they never import the planner: a job reads the spec the planner wrote."""
