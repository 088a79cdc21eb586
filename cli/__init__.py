"""The `gyre` command line: parsers, dispatch and console output; the one module of the `gyre` process
that reads the environment (settings.py).

    main.py        the parser of every command and the dispatch to tasks/, flows/ and bench/
    agents.py      rollout, model sft / eval, bench rollout
    executions.py  execution register / finish: the gateway's admin API for an external harness
    format.py      query results as an aligned table, CSV or JSON
    settings.py    GYRE_* defaults and Prefect's settings, read and set before Prefect is imported

It sits above flows/, tasks/ and bench/ (it calls them; none of them imports it).
"""
