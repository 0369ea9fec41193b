"""Planning without the model: arrival traces (`trace`), the scheduling simulator (`simulate`) and the
token-bucket planner (`bucket_plan`). Host side: no JAX.
"""
