"""Operational tools built on the runtime: the benchmarks (`taskq bench`) and the chaos check (`taskq chaos`).

Nothing in the runtime packages imports them.
"""
