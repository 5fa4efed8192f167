// edge/local's socket file: the mode is set on the socket bound, never through a symlink swapped in
// after bind; a stale socket is replaced, a live one or a non-socket is not; shutdown unlinks only
// the file it bound.
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "edge/local/socket_file.h"
#include "gtest/gtest.h"

namespace flashserve {
namespace {

class SocketFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/flashserve-socket-file-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    dir_ = dir;
  }
  void TearDown() override { std::system(("rm -rf " + dir_).c_str()); }

  std::string Path(const char* name) const { return dir_ + "/" + name; }

  static mode_t ModeOf(const std::string& path, bool follow = true) {
    struct stat st{};
    EXPECT_EQ(follow ? stat(path.c_str(), &st) : lstat(path.c_str(), &st), 0) << path;
    return st.st_mode;
  }

  static bool Connects(const std::string& path) {
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::memcpy(address.sun_path, path.data(), path.size());
    const int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    const bool ok = connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0;
    close(fd);
    return ok;
  }

  std::string dir_;
};

TEST_F(SocketFileTest, BindsWithTheModeAsked) {
  const std::string path = Path("s");
  for (int mode : {0600, 0660}) {
    auto bound = BindLocalSocket(path, mode);
    ASSERT_TRUE(bound.ok()) << bound.status();
    EXPECT_TRUE(S_ISSOCK(ModeOf(path)));
    EXPECT_EQ(ModeOf(path) & 07777, mode_t(mode));
    EXPECT_TRUE(Connects(path));
    close(bound->fd);  // now stale: the next bind replaces it
  }
}

TEST_F(SocketFileTest, TheModeIsNeverSetThroughASymlink) {
  const std::string target = Path("config"), link = Path("s");
  std::ofstream(target) << "secret\n";
  ASSERT_EQ(chmod(target.c_str(), 0600), 0);
  ASSERT_EQ(symlink(target.c_str(), link.c_str()), 0);
  auto inode = SetSocketFileMode(link, 0666);
  ASSERT_FALSE(inode.ok());
  EXPECT_EQ(inode.status().code(), absl::StatusCode::kFailedPrecondition) << inode.status();
  EXPECT_EQ(ModeOf(target) & 07777, 0600u);  // chmod(path) would have made it 0666
  EXPECT_TRUE(S_ISLNK(ModeOf(link, /*follow=*/false)));
}

TEST_F(SocketFileTest, RefusesANonSocketAndALiveSocket) {
  const std::string file = Path("file");
  std::ofstream(file) << "x";
  auto refused = BindLocalSocket(file, 0600);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(S_ISREG(ModeOf(file)));

  const std::string path = Path("s");
  auto live = BindLocalSocket(path, 0600);
  ASSERT_TRUE(live.ok()) << live.status();
  auto second = BindLocalSocket(path, 0600);
  ASSERT_FALSE(second.ok());
  EXPECT_NE(std::string(second.status().message()).find("in use"), std::string::npos)
      << second.status();
  EXPECT_TRUE(Connects(path));
  close(live->fd);
}

TEST_F(SocketFileTest, ShutdownUnlinksOnlyTheFileItBound) {
  const std::string path = Path("s");
  auto first = BindLocalSocket(path, 0600);
  ASSERT_TRUE(first.ok()) << first.status();
  // Someone moves our file aside (it keeps its inode) and another instance binds the path.
  ASSERT_EQ(rename(path.c_str(), Path("aside").c_str()), 0);
  auto second = BindLocalSocket(path, 0600);
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_NE(first->inode, second->inode);
  RemoveLocalSocket(path, first->inode);
  EXPECT_TRUE(Connects(path));
  RemoveLocalSocket(path, second->inode);
  struct stat st{};
  EXPECT_NE(lstat(path.c_str(), &st), 0);
  close(first->fd);
  close(second->fd);
}

}  // namespace
}  // namespace flashserve
