"""Injected faults: crashed, hung, preempted, stalled or slow ranks, bad values, broken storage and broken resumes.

Each is simulated for real (a signal, a stall, a flipped byte, a full disk) at the moment a spec asks for it:
``spec.py`` is the one grammar every source of faults is read with, ``injection.py`` the registry that decides when
each strikes, ``effects.py`` what some of them do to the process or its storage.
"""
