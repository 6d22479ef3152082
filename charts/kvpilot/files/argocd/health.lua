-- The checks shared by every kvpilot.dev kind, appended to the kind's own file, which defines
-- replicas() (the text after the status message). Reads `obj`; gives `hs`.
local hs = {}

local function condition(kind)
  if obj.status == nil or obj.status.conditions == nil then
    return nil
  end
  for _, c in ipairs(obj.status.conditions) do
    if c.type == kind then
      return c
    end
  end
  return nil
end

local function describe(c, fallback)
  if c ~= nil and c.message ~= nil and c.message ~= "" then
    return c.message
  end
  if c ~= nil and c.reason ~= nil and c.reason ~= "" then
    return c.reason
  end
  return fallback
end

if obj.status == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to write status"
  return hs
end

local generation = obj.metadata.generation
local observed = obj.status.observedGeneration
if generation ~= nil and (observed == nil or observed < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. generation
  return hs
end

local degraded = condition("Degraded")
if degraded ~= nil and degraded.status == "True" then
  hs.status = "Degraded"
  hs.message = describe(degraded, "Degraded")
  return hs
end

local ready = condition("Ready")
local progressing = condition("Progressing")
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = "Ready" .. replicas()
  return hs
end
if ready ~= nil and ready.status == "False" and not (progressing ~= nil and progressing.status == "True") then
  hs.status = "Degraded"
  hs.message = describe(ready, "Not ready") .. replicas()
  return hs
end

hs.status = "Progressing"
hs.message = describe(progressing, "Waiting for replicas to become ready") .. replicas()
return hs
