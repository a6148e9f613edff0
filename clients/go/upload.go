package tokensvc

import (
	"context"
	"errors"
	"io"

	tokensvcv1 "github.com/ctxmesh/tokensvc/clients/go/gen/tokensvc/v1"
)

// UploadPartSize is the size of the content messages UploadDocument streams.
const UploadPartSize = 64 << 10

// UploadDocument streams a document into a knowledge base: the header, then content read from
// r in UploadPartSize parts. An admin (or control-plane) client's call; with
// header.WaitUntilReady false it returns once the bytes are stored, the version PENDING, and
// GetDocument follows its ingestion. ctx bounds the whole upload: give it a deadline that
// covers sending the document (no default applies to streams), and with WaitUntilReady its
// ingestion as well, or the call waits as long as ingestion takes.
func (c *Client) UploadDocument(ctx context.Context, header *tokensvcv1.UploadDocumentHeader,
	r io.Reader) (*tokensvcv1.UploadDocumentResponse, error) {
	if header == nil {
		return nil, errors.New("tokensvc: UploadDocument needs a header")
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel() // ends the stream if it is left half-sent
	stream, err := c.Knowledge.UploadDocument(ctx)
	if err != nil {
		return nil, err
	}
	first := &tokensvcv1.UploadDocumentRequest{Part: &tokensvcv1.UploadDocumentRequest_Header{Header: header}}
	if err := stream.Send(first); err != nil {
		return nil, closeAfterSendFailure(stream, err)
	}
	buffer := make([]byte, UploadPartSize)
	for {
		n, readErr := io.ReadFull(r, buffer)
		if n > 0 {
			part := &tokensvcv1.UploadDocumentRequest{
				Part: &tokensvcv1.UploadDocumentRequest_Content{Content: append([]byte(nil), buffer[:n]...)},
			}
			if err := stream.Send(part); err != nil {
				return nil, closeAfterSendFailure(stream, err)
			}
		}
		if readErr == io.EOF || readErr == io.ErrUnexpectedEOF {
			break
		}
		if readErr != nil {
			return nil, readErr
		}
	}
	return stream.CloseAndRecv()
}

// closeAfterSendFailure: a Send that fails because the server ended the call returns io.EOF, and
// the server's status comes from CloseAndRecv.
func closeAfterSendFailure(stream tokensvcv1.KnowledgeService_UploadDocumentClient, err error) error {
	if errors.Is(err, io.EOF) {
		_, err = stream.CloseAndRecv()
	}
	return err
}
