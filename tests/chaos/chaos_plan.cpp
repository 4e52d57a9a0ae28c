#include "tests/chaos/chaos_plan.h"

#include <cstdlib>
#include <map>
#include <sstream>
#include <stdexcept>

namespace sfchaos {

const char* faultName(Fault f) {
  static const char* const kNames[] = {"none",        "kill",   "stop",    "late",    "extra_sync",
                                       "missing_sync", "layout", "garbage", "stranger"};
  const int i = int(f);
  return i >= 0 && i < int(Fault::kCount) ? kNames[i] : "?";
}

const char* pointName(Point p) {
  static const char* const kNames[] = {"rendezvous", "window", "midbucket", "teardown", "call", "timer"};
  const int i = int(p);
  return i >= 0 && i < int(Point::kCount) ? kNames[i] : "?";
}

std::string Plan::kind() const {
  std::string k = faultName(fault);
  if (fault == Fault::kKill || fault == Fault::kStop) k += std::string("@") + pointName(point);
  if (cuda) k += "/nccl";
  return k;
}

std::string encode(const Plan& p) {
  std::ostringstream s;
  s.precision(17);
  s << "seed=" << p.seed << ",world=" << p.world << ",micro=";
  for (size_t i = 0; i < p.micro.size(); ++i) s << (i ? ":" : "") << p.micro[i];
  s << ",blocks=" << p.blocks << ",rows=" << p.rows << ",in=" << p.in << ",batch=" << p.batch
    << ",cap=" << p.capMb << ",first=" << p.firstCapMb << ",flat=" << p.flat
    << ",ready=" << p.gradReady << ",op=" << p.reduceOp << ",timeout=" << p.timeoutMs
    << ",fault=" << int(p.fault) << ",point=" << int(p.point) << ",target=" << p.target
    << ",at=" << p.atWindow << ",delay=" << p.delayMs << ",call=" << p.callIndex
    << ",layout=" << int(p.layout) << ",cuda=" << p.cuda;
  return s.str();
}

Plan decode(const std::string& text) {
  std::map<std::string, std::string> kv;
  std::istringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    const size_t eq = item.find('=');
    if (eq == std::string::npos) throw std::runtime_error("plan item '" + item + "' has no '='");
    kv[item.substr(0, eq)] = item.substr(eq + 1);
  }
  auto num = [&](const char* key, double lo, double hi) {
    auto it = kv.find(key);
    if (it == kv.end()) throw std::runtime_error(std::string("plan has no '") + key + "'");
    char* end = nullptr;
    const double x = std::strtod(it->second.c_str(), &end);
    if (*end || !(x >= lo && x <= hi)) {
      throw std::runtime_error(std::string("plan ") + key + "='" + it->second + "' is out of range");
    }
    return x;
  };
  Plan p;
  p.seed = std::strtoull(kv["seed"].c_str(), nullptr, 10);
  p.world = int(num("world", 1, 64));
  p.micro.clear();
  std::istringstream m(kv["micro"]);
  while (std::getline(m, item, ':')) {
    const int n = std::atoi(item.c_str());
    if (n < 1 || n > 64) throw std::runtime_error("plan micro='" + kv["micro"] + "' is out of range");
    p.micro.push_back(n);
  }
  if (p.micro.empty() || p.micro.size() > 64) throw std::runtime_error("plan has no windows");
  p.blocks = int(num("blocks", 1, 64));
  p.rows = int(num("rows", 1, 256));
  p.in = int(num("in", 1, 256));
  p.batch = int(num("batch", 1, 64));
  p.capMb = num("cap", 1e-9, 1e6);
  p.firstCapMb = num("first", 1e-9, 1e6);
  p.flat = num("flat", 0, 1) != 0;
  p.gradReady = num("ready", 0, 1) != 0;
  p.reduceOp = int(num("op", 0, 1));
  p.timeoutMs = int64_t(num("timeout", 1, 1e9));
  p.fault = Fault(int(num("fault", 0, int(Fault::kCount) - 1)));
  p.point = Point(int(num("point", 0, int(Point::kCount) - 1)));
  p.target = int(num("target", 0, p.world - 1));
  p.atWindow = int(num("at", 0, double(p.micro.size()) - 1));
  p.delayMs = int64_t(num("delay", 0, 1e9));
  p.callIndex = int(num("call", 0, 1e9));
  p.layout = LayoutDiff(int(num("layout", 0, int(LayoutDiff::kNum) - 1)));
  p.cuda = kv.count("cuda") && num("cuda", 0, 1) != 0;
  if (p.cuda) p.flat = true;
  return p;
}

}  // namespace sfchaos
