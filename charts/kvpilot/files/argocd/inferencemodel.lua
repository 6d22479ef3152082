-- Argo CD health of a kvpilot.dev InferenceModel: replicas() for the shared checks in health.lua,
-- which the chart appends to this file (Argo CD runs each key as one standalone script).
-- Progressing: no status yet, status older than the spec, or Ready=False while Progressing=True.
-- Degraded: Degraded=True (a bad spec, or failing replicas: Unschedulable, ImagePullFailed,
-- WeightsDownloadFailed, CrashLoop, OOMKilled, ProgressDeadlineExceeded), or Ready=False and
-- not progressing. Healthy: Ready=True. The message ends with the replicas and the weights.

local function replicas()
  local parts = {}
  if obj.status.prefillReplicas ~= nil then
    table.insert(parts, "prefill " .. obj.status.prefillReplicas)
  end
  if obj.status.decodeReplicas ~= nil then
    table.insert(parts, "decode " .. obj.status.decodeReplicas)
  end
  if obj.status.weights ~= nil and obj.status.weights.state ~= nil then
    table.insert(parts, "weights " .. obj.status.weights.state)
  end
  if #parts == 0 then
    return ""
  end
  return " (" .. table.concat(parts, ", ") .. ")"
end
