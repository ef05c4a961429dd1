"""Why a run stops, and how its ranks stop together at the same step with nothing lost. One concern per
file:

    agreement.py    the stop agreement: every rank's ballot, one host-side MAX each step, the stop file
    causes.py       the causes (signal, budget, planned end, spike, peer lost...), which wins, exit codes
    planned_end.py  max_steps, max_tokens and max_hours, and the decay plan agreed on the way to the end
    spikes.py       loss spikes: the detector and its drill
    lease.py        RUN_DIR/lease.json: one trainer per run dir
    heartbeat.py    RUN_DIR/status.json, read by the budget watcher
    budget_link.py  the loop's one door to the budget and its watcher
"""
