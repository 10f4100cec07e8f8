"""Diagnostics: where a step's or a run's time goes (profile_step, profile_run, host_time),
a kernel's registers (gemv_regs), and one method swapped for an older copy to time a change
before and after in one call (ab_method)."""
