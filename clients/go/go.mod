module github.com/ctxmesh/tokensvc/clients/go

go 1.19

// The versions the live tests run against: Debian bookworm's golang-google-grpc-dev,
// golang-google-protobuf-dev and golang-google-genproto-dev (README, "Building"). Newer releases
// work too; with the Go module proxy, `go mod tidy` resolves them and writes go.sum.
require (
	google.golang.org/genproto v0.0.0-20200526211855-cb27e3aa2013
	google.golang.org/grpc v1.33.3
	google.golang.org/protobuf v1.28.1
)
