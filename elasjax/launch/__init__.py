"""`elasjax launch`: a process of the job (`process`, also the workers' entry point
`python -m elasjax.launch.process`), the local launcher with its attempts and restarts
(`local`), and the supervisor that restarts dead processes."""
