"""The control plane: CRD models, planning, rendering, autoscaling and the kopf handlers."""
