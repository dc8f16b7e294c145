"""The build's third stage: probe traces become programs. One program with rank bindings
(bind), a deep model's program fitted from shallow traces (stamp, deep), and which programs a
build makes (programs)."""
