#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <memory>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/clock.h"
#include "common/http_get.h"
#include "common/listing.h"
#include "common/logging.h"
#include "common/mutex.h"
#include "common/periodic.h"
#include "common/process.h"
#include "common/recent_versions.h"
#include "common/status_macros.h"
#include "common/timeout.h"
#include "common/unix_socket.h"
#include "gtest/gtest.h"
#include "tests/unit/loopback.h"
#include "tests/wait_for.h"

namespace ubep {
namespace {

absl::StatusOr<int> Half(int x) {
  if (x % 2 != 0) return absl::InvalidArgumentError("odd");
  return x / 2;
}

absl::StatusOr<int> Quarter(int x) {
  UBEP_ASSIGN_OR_RETURN(int half, Half(x));
  UBEP_ASSIGN_OR_RETURN(int quarter, Half(half));
  return quarter;
}

absl::Status CheckQuarter(int x) {
  UBEP_RETURN_IF_ERROR(Quarter(x));
  UBEP_RETURN_IF_ERROR(absl::OkStatus());
  return absl::OkStatus();
}

TEST(StatusMacrosTest, AssignOrReturnPassesValuesAndErrors) {
  EXPECT_EQ(*Quarter(12), 3);
  EXPECT_EQ(Quarter(6).status(), absl::InvalidArgumentError("odd"));
  EXPECT_EQ(Quarter(7).status(), absl::InvalidArgumentError("odd"));
}

TEST(StatusMacrosTest, ReturnIfErrorAcceptsStatusAndStatusOr) {
  EXPECT_TRUE(CheckQuarter(8).ok());
  EXPECT_EQ(CheckQuarter(10), absl::InvalidArgumentError("odd"));
}

// An answer's margin before its caller's deadline grows with the time the caller gave: a
// tenth of it, at least the floor (ubepd answered a 60 s Join 200 ms before its deadline,
// which a loaded machine could miss).
TEST(AnswerMarginTest, IsATenthOfTheTimeLeftAtLeastTheFloor) {
  EXPECT_EQ(AnswerMargin(absl::Seconds(60), absl::Milliseconds(200)), absl::Seconds(6));
  EXPECT_EQ(AnswerMargin(absl::Seconds(6), absl::Milliseconds(100)), absl::Milliseconds(600));
  EXPECT_EQ(AnswerMargin(absl::Seconds(1), absl::Milliseconds(200)), absl::Milliseconds(200));
  EXPECT_EQ(AnswerMargin(absl::ZeroDuration(), absl::Milliseconds(100)), absl::Milliseconds(100));
  EXPECT_EQ(AnswerMargin(-absl::Seconds(1), absl::Milliseconds(100)), absl::Milliseconds(100));
}

TEST(FakeClockTest, AdvancesOnlyWhenTold) {
  FakeClock clock(100);
  EXPECT_EQ(clock.NowNanos(), 100);
  clock.Advance(absl::Nanoseconds(50));
  EXPECT_EQ(clock.NowNanos(), 150);
  clock.SetNanos(7);
  EXPECT_EQ(clock.NowNanos(), 7);
}

TEST(FakeClockTest, SleepReturnsOnceAnotherThreadAdvancesPastTheDeadline) {
  FakeClock clock(0);
  std::atomic<bool> woke{false};
  std::thread sleeper([&] {
    clock.SleepFor(absl::Seconds(2));
    woke = true;
  });
  clock.AwaitSleepers(1);
  clock.Advance(absl::Seconds(1));
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_FALSE(woke.load());
  clock.Advance(absl::Seconds(1));
  sleeper.join();
  EXPECT_TRUE(woke.load());
  EXPECT_EQ(clock.NowNanos(), 2'000'000'000);
}

// An infinite sleep has no deadline the clock reaches by advancing (the deadline is held at
// int64's end, not wrapped below the clock's time); Advance holds there too.
TEST(FakeClockTest, AnInfiniteSleepEndsOnlyAtTheEndOfTime) {
  FakeClock clock(1);
  std::atomic<bool> woke{false};
  std::thread sleeper([&] {
    clock.SleepFor(absl::InfiniteDuration());
    woke = true;
  });
  clock.AwaitSleepers(1);
  clock.Advance(absl::Hours(1));
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_FALSE(woke.load());
  clock.Advance(absl::InfiniteDuration());
  sleeper.join();
  EXPECT_EQ(clock.NowNanos(), std::numeric_limits<int64_t>::max());
}

TEST(MutexTest, AwaitSeesChangesMadeByAnotherThread) {
  Mutex mu;
  int stage = 0;  // Guarded by mu.
  std::thread other([&] {
    MutexLock lock(&mu);
    stage = 1;
    mu.Await([&] { return stage == 2; });
    stage = 3;
  });
  {
    MutexLock lock(&mu);
    mu.Await([&] { return stage == 1; });
    stage = 2;
    mu.Await([&] { return stage == 3; });
  }
  other.join();
  EXPECT_EQ(stage, 3);
}

TEST(MutexTest, AwaitWithTimeoutGivesUp) {
  Mutex mu;
  MutexLock lock(&mu);
  EXPECT_FALSE(mu.AwaitWithTimeout([] { return false; }, absl::Milliseconds(5)));
  EXPECT_TRUE(mu.AwaitWithTimeout([] { return true; }, absl::Milliseconds(5)));
}

TEST(MutexTest, AnInfiniteTimeoutWaitsForThePredicate) {
  Mutex mu;
  bool set = false;  // Guarded by mu.
  std::thread other([&] {
    absl::SleepFor(absl::Milliseconds(50));
    MutexLock lock(&mu);
    set = true;
  });
  {
    MutexLock lock(&mu);
    EXPECT_TRUE(mu.AwaitWithTimeout([&] { return set; }, absl::InfiniteDuration()));
    EXPECT_TRUE(set);  // Not a wait that ended at once, with the predicate still false.
  }
  other.join();
}

TEST(PeriodicThreadTest, AnInfiniteIntervalNeverRunsTheFunction) {
  std::atomic<int> runs = 0;
  {
    PeriodicThread thread([] { return absl::InfiniteDuration(); }, [&] { ++runs; });
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_EQ(runs.load(), 0);
}

TEST(PeriodicThreadTest, RunsEveryIntervalUntilDestroyed) {
  std::atomic<int> runs = 0;
  {
    PeriodicThread thread([] { return absl::Milliseconds(1); }, [&] { ++runs; });
    ASSERT_TRUE(test::WaitFor([&] { return runs.load() >= 3; }, absl::Seconds(30)));
  }
  const int after = runs.load();
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ(runs.load(), after);
}

// A one-answer HTTP server on loopback: each connection gets `answer`, then is closed.
std::string AnswerOnce(const std::string& answer) {
  test::LoopbackListener listener;
  EXPECT_GE(listener.fd(), 0);
  std::thread server([&] {
    const int fd = accept(listener.fd(), nullptr, nullptr);
    char request[1024];
    (void)read(fd, request, sizeof(request));
    (void)write(fd, answer.data(), answer.size());
    close(fd);
  });
  const std::string body = HttpGet(listener.port(), "/metrics");
  server.join();
  return body;
}

// A child dies with the thread that started it (its parent-death signal), so nothing outlives
// a parent killed without the chance to stop its children.
TEST(ProcessTest, AChildDiesWithTheThreadThatStartedIt) {
  std::unique_ptr<Process> child;
  std::thread starter([&] { child = std::make_unique<Process>(std::vector<std::string>{"/bin/sleep", "600"}); });
  starter.join();
  ASSERT_EQ(child->spawn_error(), 0);
  EXPECT_EQ(child->Wait(absl::Seconds(30)), 128 + SIGKILL);
}

// Where SIGCHLD is ignored (inherited so across exec) the kernel reaps every child: Wait
// says the child is gone, its code lost, rather than wait out its timeout taking it for alive.
TEST(ProcessTest, AChildTheKernelReapedIsGoneWithItsCodeLost) {
  struct sigaction ignore {};
  ignore.sa_handler = SIG_IGN;
  struct sigaction before {};
  ASSERT_EQ(sigaction(SIGCHLD, &ignore, &before), 0);
  Process child({"/bin/true"});
  const std::optional<int> code = child.Wait(absl::Seconds(20));
  sigaction(SIGCHLD, &before, nullptr);
  EXPECT_EQ(code, -1);
  EXPECT_FALSE(child.running());
}

TEST(ProcessTest, ABinaryThatCannotBeStartedIsASpawnErrorAndNoProcess) {
  Process missing({"/nonexistent/ubep-binary"});
  EXPECT_EQ(missing.spawn_error(), ENOENT);
  EXPECT_EQ(missing.pid(), -1);
  EXPECT_FALSE(missing.running());
  Process unwritable({"/bin/true"}, "/nonexistent/dir/out.log");
  EXPECT_EQ(unwritable.spawn_error(), ENOENT);
  EXPECT_FALSE(unwritable.running());
}

TEST(ProcessTest, OutputAndErrorsAreAppendedToTheFileAndTheExitCodeIsKept) {
  char dir[] = "/tmp/ubep-process-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string out = std::string(dir) + "/out.log";
  {
    Process first({"/bin/sh", "-c", "echo one; echo two >&2; exit 3"}, out);
    EXPECT_EQ(first.Wait(absl::Seconds(30)), 3);
    Process second({"/bin/sh", "-c", "echo three"}, out);
    EXPECT_EQ(second.Wait(absl::Seconds(30)), 0);
  }
  std::FILE* f = std::fopen(out.c_str(), "r");
  ASSERT_NE(f, nullptr);
  char buffer[64] = {};
  const size_t n = std::fread(buffer, 1, sizeof(buffer) - 1, f);
  std::fclose(f);
  EXPECT_EQ(std::string(buffer, n), "one\ntwo\nthree\n");
  std::filesystem::remove_all(dir);
}

TEST(HttpGetTest, TheBodyOfAWhole200AnswerOnlyElseNothing) {
  EXPECT_EQ(AnswerOnce("HTTP/1.0 200 OK\r\nContent-Length: 5\r\n\r\nhello"), "hello");
  EXPECT_EQ(AnswerOnce("HTTP/1.1 200 OK\r\ncontent-length:9\r\n\r\nno length"), "no length");
  EXPECT_EQ(AnswerOnce("HTTP/1.0 200 OK\r\n\r\nto the close"), "to the close");
  // Cut short of its length: a sample "} 1234" read as "} 12" would pass for a value.
  EXPECT_EQ(AnswerOnce("HTTP/1.0 200 OK\r\nContent-Length: 100\r\n\r\nx_total 12"), "");
  EXPECT_EQ(AnswerOnce("HTTP/1.1 500 Internal Server Error\r\n\r\nerror"), "");
  EXPECT_EQ(AnswerOnce("garbage"), "");
}

TEST(RecentVersionsTest, KeepsTheNewestAndSaysWhatIsNew) {
  RecentVersions versions(2);
  EXPECT_TRUE(versions.Insert(5));
  EXPECT_FALSE(versions.Insert(5));  // Known.
  EXPECT_TRUE(versions.Insert(7));
  EXPECT_TRUE(versions.Insert(9));  // 5 goes.
  EXPECT_FALSE(versions.contains(5));
  EXPECT_FALSE(versions.Insert(3));  // Older than every version kept: gone at once.
  EXPECT_FALSE(versions.contains(3));
  versions.EraseUpTo(7);
  EXPECT_FALSE(versions.contains(7));
  EXPECT_TRUE(versions.contains(9));
  versions.clear();
  EXPECT_FALSE(versions.contains(9));
}

TEST(LoggingDeathTest, CheckFailureNamesTheConditionAndAborts) {
  const int slots = 0;
  EXPECT_DEATH(UBEP_CHECK(slots > 0) << "topology was validated",
               "common_test.cc:[0-9]+\\] Check failed: slots > 0 topology was validated");
}

TEST(LoggingTest, LogLineCarriesSeverityFileAndMessage) {
  ::testing::internal::CaptureStderr();
  UBEP_LOG(WARNING) << "rank " << 3 << " is slow";
  const std::string line = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(line.front(), 'W');
  EXPECT_NE(line.find("common_test.cc:"), std::string::npos);
  EXPECT_EQ(line.substr(line.size() - 17), "] rank 3 is slow\n");
}

// The system's monotonic clock (a wall clock would move with NTP steps and VM resumes): its
// reading lies between two readings of CLOCK_MONOTONIC taken around it, and it sleeps as long
// as asked at least.
TEST(SystemClockTest, IsMonotonic) {
  auto monotonic = [] {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
  };
  SystemClock clock;
  const int64_t before = monotonic();
  const int64_t a = clock.NowNanos();
  const int64_t after = monotonic();
  EXPECT_LE(before, a);
  EXPECT_LE(a, after);
  clock.SleepFor(absl::Milliseconds(1));
  EXPECT_GE(clock.NowNanos() - a, 1'000'000);
}

// A listener that accepts nothing: once its queue is full, a connect gives up at its timeout
// with DeadlineExceeded naming the socket, rather than blocking.
TEST(UnixSocketTest, AConnectToAListenerWhoseQueueIsFullTimesOut) {
  std::string dir = "/tmp/ubep-test-XXXXXX";
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  const std::string path = dir + "/full.sock";
  absl::StatusOr<UniqueFd> listener = ListenUnix(path, 0600);
  ASSERT_TRUE(listener.ok()) << listener.status();
  std::vector<UniqueFd> queued;
  absl::Status refused;
  for (int i = 0; i < 1000 && refused.ok(); ++i) {  // The queue holds 128 (ListenUnix).
    absl::StatusOr<UniqueFd> c = ConnectUnix(path, absl::Milliseconds(20));
    if (c.ok()) {
      queued.push_back(*std::move(c));
    } else {
      refused = c.status();
    }
  }
  EXPECT_EQ(refused, absl::DeadlineExceededError(absl::StrCat(
                         "connect ", path, ": the listener accepted no connection for 20ms "
                         "(its queue is full; is the server stuck?)")));
  EXPECT_GT(queued.size(), 0u);
  // A connection that made it is a blocking one, as its users expect.
  EXPECT_EQ(fcntl(queued.front().get(), F_GETFL) & O_NONBLOCK, 0);
  queued.clear();
  listener->reset();
  std::filesystem::remove_all(dir);
}

// A receive waits as long as its timeout says, however long: 2^32 ms (which a 32-bit poll
// timeout would have read as 0) and an infinite one both get a message sent later, and a
// short one still times out.
TEST(UnixSocketTest, AReceiveKeepsAnyTimeoutAndStillTimesOut) {
  int pair[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair), 0);
  UniqueFd a(pair[0]), b(pair[1]);
  for (const absl::Duration timeout :
       {absl::Milliseconds(int64_t{1} << 32), absl::InfiniteDuration()}) {
    std::thread sender([&] {
      absl::SleepFor(absl::Milliseconds(30));
      EXPECT_TRUE(SendMessage(b.get(), "late", {}).ok());
    });
    absl::StatusOr<ReceivedMessage> got = ReceiveMessage(a.get(), 64, timeout);
    sender.join();
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->bytes, "late");
  }
  EXPECT_EQ(ReceiveMessage(a.get(), 64, absl::Milliseconds(5)).status(),
            absl::DeadlineExceededError("no message within 5ms"));
}

// A send to a receiver that takes no message waits its timeout once the queue is full, then
// gives up; what was queued before arrives whole.
TEST(UnixSocketTest, ASendToAReceiverThatTakesNothingGivesUpAfterItsTimeout) {
  int pair[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair), 0);
  UniqueFd a(pair[0]), b(pair[1]);
  const std::string message(1000, 'x');
  int queued = 0;
  absl::Status sent;
  while (queued < 1'000'000 && (sent = SendMessage(b.get(), message, {}, absl::Milliseconds(50))).ok()) {
    ++queued;
  }
  EXPECT_EQ(sent, absl::DeadlineExceededError("the receiver took no message for 50ms"));
  EXPECT_GT(queued, 0);
  absl::StatusOr<ReceivedMessage> first = ReceiveMessage(a.get(), 1000, absl::Seconds(1));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(first->bytes, message);
}

// More fds than one socket message takes (253): a group of 300 ranks' arenas arrive whole,
// in order, with the message's bytes; and the next message is a message of its own.
TEST(UnixSocketTest, AMessageCarriesMoreFdsThanOneSocketMessageTakes) {
  int pair[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair), 0);
  UniqueFd a(pair[0]), b(pair[1]);
  std::vector<UniqueFd> files;
  std::vector<int> fds;
  for (int i = 0; i < 300; ++i) {
    files.emplace_back(memfd_create("ubep-test", MFD_CLOEXEC));
    ASSERT_GE(files.back().get(), 0);
    ASSERT_EQ(ftruncate(files.back().get(), 4096 * (i + 1)), 0);  // Tells the files apart.
    fds.push_back(files.back().get());
  }
  ASSERT_TRUE(SendMessage(b.get(), "OK 7", fds).ok());
  ASSERT_TRUE(SendMessage(b.get(), "next", {}).ok());
  absl::StatusOr<ReceivedMessage> got = ReceiveMessage(a.get(), 64, absl::Seconds(10));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->bytes, "OK 7");
  ASSERT_EQ(got->fds.size(), 300u);
  for (int i = 0; i < 300; ++i) {
    struct stat st{};
    ASSERT_EQ(fstat(got->fds[i].get(), &st), 0);
    EXPECT_EQ(st.st_size, 4096 * (i + 1)) << "fd " << i;
  }
  absl::StatusOr<ReceivedMessage> next = ReceiveMessage(a.get(), 64, absl::Seconds(10));
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->bytes, "next");
  EXPECT_TRUE(next->fds.empty());
  EXPECT_EQ(SendMessage(b.get(), "x", std::vector<int>(2049, fds[0])),
            absl::InvalidArgumentError("cannot pass 2049 fds (max 2048)"));
}

// In a child (EXPECT_EXIT): leaves three descriptors free under its open-files limit,
// receives one message on `socket`, prints its status and exits 0 if it is ResourceExhausted
// and, where `then` is given, the next message received (with the descriptors back) is
// `then`, with no fds.
void ReceiveWithFewDescriptorsFree(int socket, const char* then = nullptr) {
  int highest = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    highest = std::max(highest, std::atoi(entry.path().filename().c_str()));
  }
  const rlimit limit{static_cast<rlim_t>(highest + 1), static_cast<rlim_t>(highest + 1)};
  setrlimit(RLIMIT_NOFILE, &limit);
  // Every free number under the limit taken, then three given back.
  std::vector<int> taken;
  for (int fd; (fd = dup(socket)) >= 0;) taken.push_back(fd);
  for (int i = 0; i < 3 && !taken.empty(); ++i) {
    close(taken.back());
    taken.pop_back();
  }
  const absl::Status got = ReceiveMessage(socket, 64, absl::Seconds(10)).status();
  std::fprintf(stderr, "%s\n", got.ToString().c_str());
  if (!absl::IsResourceExhausted(got)) std::_Exit(1);
  if (then == nullptr) std::_Exit(0);
  for (int fd : taken) close(fd);
  const absl::StatusOr<ReceivedMessage> next = ReceiveMessage(socket, 64, absl::Seconds(10));
  std::fprintf(stderr, "then: %s\n",
               next.ok() ? absl::StrCat("\"", next->bytes, "\" with ", next->fds.size(), " fds").c_str()
                         : next.status().ToString().c_str());
  std::_Exit(next.ok() && next->bytes == then && next->fds.empty() ? 0 : 1);
}

// A sender that goes away between a message's parts (after a continuation that carried fds)
// is a message lost, not an empty message with fds; the fds received are closed.
TEST(UnixSocketTest, AMessageCutShortBetweenItsPartsIsDataLoss) {
  int pair[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair), 0);
  UniqueFd a(pair[0]), b(pair[1]);
  int pipe_fds[2];
  ASSERT_EQ(pipe2(pipe_fds, O_CLOEXEC), 0);
  UniqueFd pipe_read(pipe_fds[0]), pipe_write(pipe_fds[1]);
  // The first part of a multi-part message as SendMessage writes it: the continuation marker
  // and fds (here two).
  char marker[] = "\x01more fds";
  iovec iov{marker, sizeof(marker) - 1};
  const int fds[2] = {pipe_read.get(), pipe_write.get()};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(fds))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(fds));
  std::memcpy(CMSG_DATA(c), fds, sizeof(fds));
  ASSERT_EQ(sendmsg(b.get(), &msg, 0), static_cast<ssize_t>(sizeof(marker) - 1));
  b.reset();
  EXPECT_EQ(ReceiveMessage(a.get(), 64, absl::Seconds(10)).status(),
            absl::DataLossError(
                "the connection closed part-way through a message, after 2 of its fds"));
  // A whole message of no bytes but fds is still a message, not the end of the stream.
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair), 0);
  a = UniqueFd(pair[0]);
  b = UniqueFd(pair[1]);
  std::vector<int> many(300, pipe_read.get());
  ASSERT_TRUE(SendMessage(b.get(), "", many).ok());
  absl::StatusOr<ReceivedMessage> got = ReceiveMessage(a.get(), 64, absl::Seconds(10));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->bytes, "");
  EXPECT_EQ(got->fds.size(), 300u);
  EXPECT_FALSE(got->closed);
}

// A sender whose continuations go on past any message's fds (here with none: SendMessage's
// carry 253 each) cannot hold the reader, which took parts for as long as they came (ubepd's
// fd server, whose one thread serves every client, reads with no deadline of its own): past
// the parts of the largest message it stops, DataLoss.
TEST(UnixSocketTest, ContinuationsPastTheLargestMessageAreDataLoss) {
  int pair[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair), 0);
  UniqueFd a(pair[0]), b(pair[1]);
  for (int i = 0; i < 9; ++i) {  // With the last, a tenth part.
    ASSERT_EQ(send(b.get(), "\x01more fds", 9, 0), 9);
  }
  ASSERT_TRUE(SendMessage(b.get(), "end", {}).ok());
  EXPECT_EQ(ReceiveMessage(a.get(), 64, absl::ZeroDuration()).status(),
            absl::DataLossError("message of more than 9 parts (2048 fds at most, 253 a part)"));
  // Nine parts (eight continuations and the last) are still one message.
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair), 0);
  a = UniqueFd(pair[0]);
  b = UniqueFd(pair[1]);
  for (int i = 0; i < 8; ++i) ASSERT_EQ(send(b.get(), "\x01more fds", 9, 0), 9);
  ASSERT_TRUE(SendMessage(b.get(), "end", {}).ok());
  absl::StatusOr<ReceivedMessage> got = ReceiveMessage(a.get(), 64, absl::ZeroDuration());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->bytes, "end");
}

// A receiver whose descriptor table is nearly full (its open-files limit) gets some of a
// message's fds: the error says so, and which limit, rather than calling the message too large.
TEST(UnixSocketTest, FdsThatDoNotFitTheReceiversTableAreCalledThat) {
  int pair[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair), 0);
  UniqueFd a(pair[0]), b(pair[1]);
  std::vector<UniqueFd> files;
  std::vector<int> fds;
  for (int i = 0; i < 16; ++i) {
    files.emplace_back(memfd_create("ubep-test", MFD_CLOEXEC));
    fds.push_back(files.back().get());
  }
  ASSERT_TRUE(SendMessage(b.get(), "OK", fds).ok());
  EXPECT_EXIT(ReceiveWithFewDescriptorsFree(a.get()),
      ::testing::ExitedWithCode(0),
      "RESOURCE_EXHAUSTED: out of file descriptors: [0-9]+ of a message's fds fit this "
      "process's table \\(its open-files limit is [0-9]+; raise it, ulimit -n\\)");
}

// The same with a message of several parts (300 fds): its parts after the one that did not
// fit are read and dropped, so that the next message received is the next one sent, not the
// rest of this one passing for a reply.
TEST(UnixSocketTest, AMessageOfSeveralPartsThatDoesNotFitLeavesNoPartBehind) {
  int pair[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair), 0);
  UniqueFd a(pair[0]), b(pair[1]);
  UniqueFd file(memfd_create("ubep-test", MFD_CLOEXEC));
  ASSERT_TRUE(SendMessage(b.get(), "OK", std::vector<int>(300, file.get())).ok());
  ASSERT_TRUE(SendMessage(b.get(), "next", {}).ok());
  EXPECT_EXIT(ReceiveWithFewDescriptorsFree(a.get(), "next"), ::testing::ExitedWithCode(0),
              "RESOURCE_EXHAUSTED: out of file descriptors: [0-9]+ of a message's fds fit "
              "this process's table .*\nthen: \"next\" with 0 fds");
}

// A list in a message: the first items, each cut to its bound, and how many more.
TEST(JoinFirstTest, ListsTheFirstItemsCutAndCountsTheRest) {
  EXPECT_EQ(JoinFirst({}, 3, "; "), "");
  EXPECT_EQ(JoinFirst({"a", "b"}, 3, "; "), "a; b");
  EXPECT_EQ(JoinFirst({"a", "b", "c"}, 3, "; "), "a; b; c");
  EXPECT_EQ(JoinFirst({"a", "b", "c", "d", "e"}, 3, "; "), "a; b; c; and 2 more");
  EXPECT_EQ(JoinFirst({"abcdef", "xy"}, 1, ", ", 4), "abcd..., and 1 more");
  const std::vector<std::string> reasons(500, std::string(5000, 'r'));
  EXPECT_EQ(JoinFirst(reasons, 8, "; ").size(), 8 * 1027 + 7 * 2 + std::string("; and 492 more").size());
}

}  // namespace
}  // namespace ubep

