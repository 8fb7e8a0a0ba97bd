#include "busy_clock.h"

#include <c10/core/impl/VirtualGuardImpl.h>

namespace hsync {

Instant Instant::now(at::Device device) {
  Instant instant;
  if (device.is_cuda()) {
    // Timed, unlike torch's default events.
    instant.event_ = std::make_shared<c10::Event>(device.type(), c10::EventFlag::BACKEND_DEFAULT);
    instant.event_->record(c10::impl::VirtualGuardImpl(device.type()).getStream(device));
  } else {
    instant.host_ = std::chrono::steady_clock::now();
  }
  return instant;
}

double Instant::seconds_since(const Instant& earlier) const {
  if (event_ == nullptr) return std::chrono::duration<double>(host_ - earlier.host_).count();
  event_->synchronize();
  return earlier.event_->elapsedTime(*event_) / 1e3;
}

BusyInterval::BusyInterval(Instant start, Instant end, std::vector<std::pair<Instant, Instant>> waits)
    : start_(std::move(start)), end_(std::move(end)), waits_(std::move(waits)) {}

double BusyInterval::seconds() const {
  double busy = end_.seconds_since(start_);  // first: on a GPU, every wait's end comes before it
  for (const auto& [begun, ended] : waits_) busy -= ended.seconds_since(begun);
  return busy;
}

void BusyClock::start() {
  const std::lock_guard<std::mutex> lock(mutex_);
  start_ = Instant::now(device_);
  waits_.clear();
  wait_begun_.reset();
  wait_depth_ = 0;
}

std::optional<BusyInterval> BusyClock::stop() {
  const std::lock_guard<std::mutex> lock(mutex_);
  if (!start_) return std::nullopt;
  BusyInterval interval(std::move(*start_), Instant::now(device_), std::move(waits_));
  start_.reset();
  waits_.clear();
  return interval;
}

std::optional<double> BusyClock::seconds_so_far() {
  std::optional<BusyInterval> so_far;
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (!start_) return std::nullopt;
    so_far.emplace(*start_, Instant::now(device_), waits_);
  }
  return so_far->seconds();  // outside the lock: it may wait for the device
}

void BusyClock::begin_wait() {
  const std::lock_guard<std::mutex> lock(mutex_);
  if (start_ && wait_depth_++ == 0) wait_begun_ = Instant::now(device_);
}

void BusyClock::end_wait() {
  const std::lock_guard<std::mutex> lock(mutex_);
  if (!start_ || wait_depth_ == 0 || --wait_depth_ > 0) return;
  Instant begun = std::move(*wait_begun_);
  wait_begun_.reset();  // first: should reading the time throw, the clock is left as if the wait were not there
  waits_.emplace_back(std::move(begun), Instant::now(device_));
}

}  // namespace hsync
