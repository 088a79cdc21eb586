"""The local stack's processes: what `gyre up` starts and stops, and what a campaign talks to.

    up.py         `gyre up` / `gyre down` / `gyre status`: the Prefect server, the engines and the gateway
                  as detached processes recorded under the data root, revived when they die
    stack.py      a stack for the duration of a block (benchmarks, `gyre rollout --model`, tests)
    campaign.py   a campaign's view of its stack (`Services`: addresses and admin tokens) and how the
                  engines' policy version is set
    placement.py  which engines serve rollouts and which cells train, asked by a step at each phase
    zombies.py    the automation that marks a flow run whose process died as CRASHED
    serve.py      the gateway and an engine run in the CLI's own process (`gyre gateway`, `gyre engine`)

Nothing here is a Prefect task: these are the processes the tasks of tasks/ run against.
"""
