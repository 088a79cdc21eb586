"""The services a campaign runs on: what `gyre up` starts and stops, a campaign's view of them, and
its cells on the hosts of a cluster. Nothing here is a Prefect task: these are the processes the
tasks of tasks/ run against.

    up.py             `gyre up` / `gyre down` / `gyre status`: the Prefect server, the engines and the
                      gateway as detached processes recorded under the data root, revived when they die
    stack.py          a stack for the duration of a block (benchmarks, `gyre rollout --model`, tests)
    serving.py        [serving], and which engine process to start; devices.py: each cell's devices
    campaign.py       a campaign's view of its stack (`Services`: addresses and admin tokens) and how the
                      engines' policy version is set
    placement.py      which engines serve rollouts and which cells train, asked by a step at each phase
    cluster_config.py [cluster]: the hosts, their work pools and cells, where the core's ranks go
    cell.py           a cell's life on its host (the body of its Prefect flow run, flows/cell.py)
    fleet.py          the cells placed on hosts, watched and replaced when a host is lost
    core_ranks.py     the core's ranks above 0 on other hosts, one flow run each per step
    zombies.py        the automation that marks a flow run whose process died as CRASHED
    serve.py          the gateway and an engine run in the CLI's own process (`gyre gateway`, `gyre engine`)
"""
