-- wrk: the response cache's bench_features variants (loadtest/bench_features.py). The request of
-- wrk_features.lua made cacheable (temperature 0). CACHE_MODE "misses": every request's content is
-- new (thread id + counter), so each is a miss (a GET, then a SET of its answer): the cache at a 0 %
-- hit rate. "hits": every request the same, so after the first each is a hit (no provider).
-- done() prints:  OVERHEAD_MS n=<count> missing=<count> p50=<ms> p90=<ms> p99=<ms> max=<ms>
-- (a hit reaches no provider and carries no x-gridgate-overhead-ms: it is counted as missing)
local mode = "CACHE_MODE"
local threads = {}
local counter = 0

function setup(thread)
  table.insert(threads, thread)
  thread:set("id", #threads)
end

function init(args)
  overhead = {}
  missing = 0
  -- each wrk run's contents its own (a warm-up's answers must not be the measured run's hits)
  run = RUN_ID .. "-" .. os.time()
end

function request()
  counter = counter + 1
  local content = "Say hello in five words."
  if mode == "misses" then
    content = content .. " " .. id .. "-" .. counter .. "-" .. run
  end
  local body = '{"model":"demo-model","messages":[{"role":"user","content":"' .. content ..
    '"}],"max_tokens":16,"temperature":0}'
  local headers = {
    ["Content-Type"] = "application/json",
    ["Authorization"] = "Bearer sk-bench",
    ["X-Session-Id"] = "session-" .. (counter % 1000),
  }
  return wrk.format("POST", nil, headers, body)
end

function response(status, headers, body)
  local value = nil
  for name, v in pairs(headers) do
    if string.lower(name) == "x-gridgate-overhead-ms" then
      value = tonumber(v)
    end
  end
  if value then
    overhead[#overhead + 1] = value
  else
    missing = missing + 1
  end
end

local function percentile(sorted, p)
  if #sorted == 0 then return 0 end
  local index = math.max(1, math.ceil(p / 100 * #sorted))
  return sorted[index]
end

function done(summary, latency, requests)
  local all, lost = {}, 0
  for _, thread in ipairs(threads) do
    for _, v in ipairs(thread:get("overhead")) do all[#all + 1] = v end
    lost = lost + thread:get("missing")
  end
  table.sort(all)
  io.write(string.format("OVERHEAD_MS n=%d missing=%d p50=%.4f p90=%.4f p99=%.4f max=%.4f\n",
    #all, lost, percentile(all, 50), percentile(all, 90), percentile(all, 99), percentile(all, 100)))
end
