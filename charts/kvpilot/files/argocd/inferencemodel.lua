-- Argo CD health of a kvpilot.dev InferenceModel: replicas() for the shared checks in health.lua,
-- which the chart appends to this file (Argo CD runs each key as one standalone script).
-- Progressing: no status yet, status older than the spec, or Ready=False while Progressing=True.
-- Degraded: Degraded=True, or Ready=False and not progressing. Healthy: Ready=True.

local function replicas()
  local parts = {}
  if obj.status.prefillReplicas ~= nil then
    table.insert(parts, "prefill " .. obj.status.prefillReplicas)
  end
  if obj.status.decodeReplicas ~= nil then
    table.insert(parts, "decode " .. obj.status.decodeReplicas)
  end
  if #parts == 0 then
    return ""
  end
  return " (" .. table.concat(parts, ", ") .. ")"
end
