{{/*
The operator's namespaced rules: exactly the calls it makes (kvpilot.operator.rbac.RULES,
scope "namespaced"); tests/chart/test_rbac.py checks them per mode. rbac.yaml puts them into
the ClusterRole when every namespace is watched, else into one Role per watched namespace.
*/}}
{{- define "kvpilot.namespacedRules" -}}
# kopf watches InferenceModels and keeps its progress in their annotations.
- apiGroups: ["kvpilot.dev"]
  resources: ["inferencemodels"]
  verbs: ["get", "list", "patch", "watch"]
- apiGroups: ["kvpilot.dev"]
  resources: ["inferencemodels/status", "prefillpools/status", "decodepools/status"]
  verbs: ["patch"]
# Pools are owned children of InferenceModels (server-side apply) and reconciled themselves.
- apiGroups: ["kvpilot.dev"]
  resources: ["prefillpools", "decodepools"]
  verbs: ["create", "delete", "list", "patch", "watch"]
- apiGroups: ["apps"]
  resources: ["deployments", "statefulsets"]
  verbs: ["create", "delete", "list", "patch", "watch"]
- apiGroups: [""]
  resources: ["services", "configmaps", "serviceaccounts"]
  verbs: ["create", "delete", "list", "patch"]
# The router's EndpointSlice reader Role; granting it needs the operator to hold it too.
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["create", "delete", "list", "patch"]
- apiGroups: ["discovery.k8s.io"]
  resources: ["endpointslices"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["create", "delete", "list", "patch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
# Status reasons come from pool and weights Job pods; the autoscaler scrapes ready pool pods
# and sets pod-deletion-cost before a scale-down.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "patch", "watch"]
# The last progress line of a weights download (status.weights.progress).
- apiGroups: [""]
  resources: ["pods/log"]
  verbs: ["get"]
# A model's weight cache: the claim and the Job that fills it (the Job is watched).
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["create", "delete", "list", "patch", "watch"]
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["create", "delete", "list", "patch"]
{{- if .Values.operator.leaderWorkerSet }}
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets"]
  verbs: ["create", "delete", "list", "patch"]
{{- end }}
{{- if .Values.operator.inferencePool }}
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["create", "delete", "list", "patch"]
{{- end }}
{{- end -}}
