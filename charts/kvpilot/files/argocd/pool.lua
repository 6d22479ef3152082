-- Argo CD health of a kvpilot.dev PrefillPool or DecodePool: replicas() for the shared checks in
-- health.lua, which the chart appends to this file (Argo CD runs each key as one standalone script).
-- Progressing: no status yet, status older than the spec, fewer ready replicas than asked
-- while nothing is wrong. Degraded: Degraded=True, or Ready=False and not progressing.
-- Healthy: Ready=True.

local function replicas()
  local desired = 1
  if obj.spec ~= nil and obj.spec.replicas ~= nil then
    desired = obj.spec.replicas
  end
  return " (" .. (obj.status.readyReplicas or 0) .. "/" .. desired .. " replicas ready)"
end
