"""The resiliency drill: train under ft_launcher, inject a schedule of real faults, and measure what they cost.

``python -m megatron.bridge.drill`` (or ``bash scripts/run_main_job.sh``) makes a corpus offline and trains the CPU
Llama recipe on it (two pipeline stages) twice with every resiliency feature on, in-process restart inside
ft_launcher's in-job restart: once without faults (the reference) and once with a schedule of real faults (a rank
killed, a preemption signal, a NaN loss, a corrupted local checkpoint, a rank stalled in a step, a slowed rank).
It prints, for each fault, when it struck, how long detection and recovery took and how many steps were lost; each
restart phase by phase; the job's goodput across restarts; and whether the final weights equal the reference's bit
for bit. It writes a timeline plot, TensorBoard logs and a JSON report. Modules: ``schedule`` (what to inject),
``runner`` (launch and watch), ``events`` (what the job's event stream says happened), ``report`` (tables, JSON,
TensorBoard), ``plot`` (timeline PNG), ``cli`` (the command), ``projection`` (goodput projected to cluster scale).
"""
