"""The fleet simulator (docs/architecture.md §15): the real RunWorkflow, simulated activities.

    cluster = SimulatedCluster(["n1", "n2", "n3"], FailureSchedule.crash_every_generation(300, 150, world_size=4))
    async with simulated_workers(client, cluster):
        result = await client.execute_workflow(RunWorkflow.run, spec, id="run", task_queue="stayalive")

sim/cluster.py holds the simulated run (steps, checkpoints, failures, the node pool);
sim/activities.py answers the workflow's activities from it, the run monitor's reports from
sim/monitor.py; sim/workers.py serves them. sim/scenario.py is one run through every kind of
interruption, sim/month.py a month under the time-skipping test server with failures from the
measured mix (sim/failure_mix.py), read by sim/measure.py; sim/history.py counts what they cost.
"""
