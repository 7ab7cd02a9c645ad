"""How a job's processes and devices are driven: the in-process runtime, the multi-controller runtime (one process per host, real deaths), liveness, collectives and point-to-point transfers."""
