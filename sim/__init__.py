"""The discrete-event simulator: scheduler/policy.py run unchanged against modelled engines and trainers."""
